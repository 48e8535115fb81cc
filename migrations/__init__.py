"""kafold.migrations"""
