#!/bin/sh
# The sample project's CI check, run inside the microVM: its tests, and a report to copy back.
set -e
echo "running in $(hostname), kernel $(uname -r), as $(id -un)"
python3 -m unittest discover -v -s tests -t . 2>&1 | tee test-report.txt
