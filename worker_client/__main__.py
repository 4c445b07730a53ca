import sys

from worker_client.cli import main

sys.exit(main())
