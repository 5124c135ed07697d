"""Key/value cache: fixed-size blocks handed out to sequences, and the storage they index."""
