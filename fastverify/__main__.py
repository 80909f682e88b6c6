from fastverify.cli import main

raise SystemExit(main())
