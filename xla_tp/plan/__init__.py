"""Plan front-ends: every plan format is lowered to one normalised ``Layout``."""
