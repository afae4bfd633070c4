// Compiled only to build the exercises' precompiled headers (ShardLab.cmake).
