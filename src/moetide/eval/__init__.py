"""Quality harness: held-out perplexity per workload against expert memory (`moetide eval`)."""
