import sys

from meshtrain.cli import main

sys.exit(main())
