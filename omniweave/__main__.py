from omniweave.cli import main

raise SystemExit(main())
