from fusesearch.cli import main
import sys
sys.exit(main())
