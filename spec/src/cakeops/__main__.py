from cakeops.cli import main

raise SystemExit(main())
