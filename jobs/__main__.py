from jobs.cli import main

raise SystemExit(main())
