"""Image layers: written in one streaming pass (tar, diffID, compression, digest), read as
an image filesystem without unpacking, and the lazy layer's table of contents (v2: the seekable
gzip writer in lazygzip). Layers only: which
registry or file they come from is the transports' business."""
