// Compiled only to build the precompiled headers of the exercises and the programs
// (ShardLab.cmake).
