"""What the scheduler service and the worker both use: addresses, credentials, logs,
argument types, the prefix block hash, load helpers. Imports neither `service` nor
`worker_client`."""
