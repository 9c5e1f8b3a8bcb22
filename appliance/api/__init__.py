"""The site's API: the routes, keys, the gateway and each request's exchange, admission by priority class,
where a request is answered (local, regional, refused), and the engine leg and splice of local streams."""
