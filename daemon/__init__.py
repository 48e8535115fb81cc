"""kafold.daemon"""
