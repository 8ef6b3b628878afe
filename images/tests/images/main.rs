//! Integration tests of ongrid-images: freeze a tar built here, then check the SIF with tools
//! that share no code with ours (sylabs' `siftool`, squashfs-tools' `unsquashfs`,
//! squashfs-tools-ng's `sqfs2tar`), and check that failures leave nothing behind.

mod failures;
mod fixture;
mod freeze;
