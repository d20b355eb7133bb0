"""Streaming building blocks every pass over a disk uses: compressors, hashing readers, a
forward-only cursor for tarfile, read-ahead threads, large files read or written around the page cache
(O_DIRECT), sparse writes and durable (fsync, rename) files.
They hold at most a few chunks in memory and know nothing of images or registries."""
