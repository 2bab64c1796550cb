from fake_gpu.cli import main

raise SystemExit(main())
