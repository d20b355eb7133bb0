"""The node's chunk sources: where a chunk of a disk the node is asked for can come from, already
verified against what the image's lazy TOC pins. The node-wide index of chunks held in the cache
(disks pulled, lazy exports complete) and the local source built on it live here; they know the
cache only as a root directory and never fetch anything, nor import the node's pulls or the disk server."""
