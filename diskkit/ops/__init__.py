"""What the commands do, as functions: build, copy (skopeo copy), verify and inspect, upload.
They compose transports, layers and disks; argument parsing and output belong to diskkit.cli."""
