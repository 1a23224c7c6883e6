from flashpage.cli import main

raise SystemExit(main())
