"""OCI images as template root filesystems (issue 34): a reference, fetched and verified, applied into a tree.

    ref = parse_ref("docker://registry.example.org/team/node:22")
    image = fetch(ref, workdir, ImageLimits())             # skopeo, confined; then our own verification
    stats = apply_layers(image.layers, root, ImageLimits())  # root inside a 0700 root-owned directory
    image.config.to_json()                                 # {"env": [...], "workdir": "...", "user": "..."}
    ref.pinned(image.source_digest)                        # what a rebuild fetches, unless refreshed

vmimages/oci/fetch.py tells the flow and why each step; every refusal is a runner.errors.ImageError.
"""

from vmimages.oci.config import ImageConfig, parse_config
from vmimages.oci.fetch import FetchedImage, fetch, verify_layout
from vmimages.oci.layers import Layer, UnpackStats, apply_layers
from vmimages.oci.limits import ImageLimits
from vmimages.oci.reference import ImageRef, parse_ref

__all__ = ["FetchedImage", "ImageConfig", "ImageLimits", "ImageRef", "Layer", "UnpackStats", "apply_layers",
           "fetch", "parse_config", "parse_ref", "verify_layout"]
