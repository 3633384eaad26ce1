"""`tandem up`: one machine's whole stack (workers and router) as child processes."""
