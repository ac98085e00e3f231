"""Front end: code that turns the user's program into the OpGraph (trace-level passes)."""
