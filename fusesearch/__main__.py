import sys

from fusesearch.cli import main

sys.exit(main())
