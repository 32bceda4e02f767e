"""Scale-out: the prebuild's stages as steps of an existing pipeline engine (datatrove)."""
