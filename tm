Command exited with non-zero status 2
276308
