"""Layer 8, what a person looks at and keeps: the text/JSON dump, the HTML report, the plan
cache and the runner-ups (rival methods priced beside the chosen plan). Imports every layer
below it; the driver (`autopar.api`, `autopar.passes`) and the command line sit above."""
