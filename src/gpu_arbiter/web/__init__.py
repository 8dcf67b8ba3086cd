"""What the project's HTTP listeners (the controller's and the gateway's) accept before
any app sees a request: bounded heads and connections (:mod:`.connections`), and the
``Host`` and simple-request rules that keep browsers out (:mod:`.guards`); and how they
write JSON: strict, a number that is not finite never failing an answer
(:mod:`.jsontext`). One implementation for both; neither imports the other's package."""
