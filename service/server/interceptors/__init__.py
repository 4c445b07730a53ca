"""Server interceptors: authentication and roles, undecodable requests, stream caps."""
