"""CDI's DataVolumes on this node: where a DataVolume's claim lives and its phase
file, the importer (http, registry, blank, clone), the upload server, and the controller deciding
what a VM waits for. Fills claims; never defines a VM."""
