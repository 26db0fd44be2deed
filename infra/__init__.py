"""Helpers of mgrpo.py: the store's file layer (store.py) and run infrastructure (runtime.py)."""
