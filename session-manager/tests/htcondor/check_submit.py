#!/usr/bin/env python3
"""HTCondor's own parser over ongrid's submit descriptions, offline (no schedd).

Reads JSON from stdin: {"descriptions": {NAME: TEXT}, "machines": {NAME: CLASSAD TEXT}}.
Writes JSON to stdout: {NAME: {"ad": JOB AD as ClassAd JSON, "matches": {MACHINE: BOOL}}} or
{NAME: {"error": MESSAGE}} for a description HTCondor refuses.

Needs the PyPI package htcondor>=24,<25 (deploy/python-requirements.txt): its 25.x wheels
dropped Submit.jobs(), which turns a description into job ads without a schedd.
"""
import json
import sys
import warnings

# htcondor before classad: htcondor registers its ClassAd functions (countMatches, ...) when
# imported; ads parsed by a classad imported first use the plain library's functions.
warnings.simplefilter("ignore")
import htcondor  # noqa: E402
import classad  # noqa: E402


def main():
    request = json.load(sys.stdin)
    machines = {
        name: classad.parseOne(text) for name, text in request["machines"].items()
    }
    result = {}
    for name, text in request["descriptions"].items():
        try:
            ads = list(htcondor.Submit(text).jobs(clusterid=1))
        except Exception as error:  # HTCondor's refusal, in its words
            result[name] = {"error": str(error)}
            continue
        if len(ads) != 1:
            result[name] = {"error": "%d job ads, not 1" % len(ads)}
            continue
        ad = ads[0]
        result[name] = {
            "ad": json.loads(ad.printJson()),
            "matches": {m: bool(ad.symmetricMatch(ma)) for m, ma in machines.items()},
        }
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
