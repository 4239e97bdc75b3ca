"""Benchmarks: pdserve measured alone and side by side with what a user would pick instead (`pdserve bench`,
`python -m pdserve.bench.versus`); bench/README.md has the map."""
