from wide.cli import main

raise SystemExit(main())
