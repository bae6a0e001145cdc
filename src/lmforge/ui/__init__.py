"""`lmforge ui`: the local web app (see app.py)."""
