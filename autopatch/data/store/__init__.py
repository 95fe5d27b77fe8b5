"""Where samples are kept: the node-local lmdb store and Redis (a server per node, or servers by
URL), each entry sealed with the user's key and written without pickle, writes buffered, and
failures kept away from training."""
