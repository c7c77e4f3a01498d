"""The action's JUnit reading. The parser is runner/junit.py (a leaf module, like runner/tarsafe.py),
shared with the service, which reads the same reports to sign and post their totals: one way to count."""

from runner.junit import (
                          MAX_REPORT_BYTES,
                          Failure,
                          JUnitError,
                          Totals,
                          looks_like_junit,
                          parse_report,
                          parse_xml,
                          read_report,
)

__all__ = ["MAX_REPORT_BYTES", "Failure", "JUnitError", "Totals", "looks_like_junit", "parse_report", "parse_xml",
           "read_report"]
