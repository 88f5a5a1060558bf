"""The proxy's side towards the apiservers: pooled HTTP/1.1 connections, streaming both ways.
"""
