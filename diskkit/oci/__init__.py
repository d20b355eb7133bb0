"""The OCI image model: descriptors, platforms, configs, manifests and indexes, media types, and
image references in the containers-transports syntax. Pure data and parsing: no I/O, no network."""
