"""What the scheduler service and the worker both use: addresses, credentials, logs,
argument types, the prefix block hash, load helpers; and for tests and scripts, bounded
waits (`waiting`) and the processes they start (`processes`). Imports neither `service`
nor `worker_client`."""
