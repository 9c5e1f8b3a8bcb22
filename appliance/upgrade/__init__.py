"""Changing the box's model or engine while it serves: versions, the golden-set gate, the upgrade itself."""
