"""Where keys and values live: static and offloaded KV caches, level 2's retrieval cache, and the memory plan that
sizes and places them before anything is allocated."""
