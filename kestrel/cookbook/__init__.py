"""The deployment cookbook: a sourced hardware catalog, a capacity planner with SGLang's state/KV memory
calculator and a decode roofline, launch recipes for kestrel, SGLang and vLLM, evidence records with the
verification matrix and claims ledger derived from them, and a static web page.

Entry points: `cli.add_commands` (kestrel plan | recipe | verify | matrix | site), `planner.plan`,
`recipes.make_recipe`, `verify.verify`, `web.build_site` / `web.site_files`.
"""
