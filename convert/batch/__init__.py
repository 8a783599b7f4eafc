"""``convert-bnb batch``: many conversions, resumable, on local processes or Ray."""
