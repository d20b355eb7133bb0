"""Where a build's disk comes from when it is not a local file: an http(s) URL read as a stream that
survives dropped connections, or a pipe; and the checksums an upstream publishes, checked over the
bytes as they arrive. The disk lands once, unwrapped, in the caller's work directory; it knows
nothing of images or registries."""
