"""The storage floor: atomic files, object stores, the library's cache dir; data/ and run/ both stand on it."""
