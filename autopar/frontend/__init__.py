"""The user's side of the step: their meshes (explicit axes) and, later, their objects."""
