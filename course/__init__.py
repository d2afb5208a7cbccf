"""The course's own tooling, kept out of kvlib so that kvlib holds only the final code.

``plots``: one look for every figure, and figures saved with the numbers that drew them.
``bench``: ``python -m course.bench``, every cache measured in one run, the reference figures.
"""
