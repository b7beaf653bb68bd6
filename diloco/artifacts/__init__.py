"""What a run leaves behind for use: the export and the trained-model loader."""
