"""What the routes call: job submission, lookup and control (``jobs``) and pipelines (``pipelines``). The routes
parse a request, call a service and shape its answer; no route module imports another."""
