//! `docs/config-reference.md` against [`super::ConfigFile`]: its gateway example names every
//! key of the gateway's config file and no other (see `ongrid_service::config_reference`).

use ongrid_service::config_reference::{check, toml_blocks};

use super::ConfigFile;

#[test]
fn the_reference_names_every_key_of_the_gateway_and_no_other() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/config-reference.md");
    let reference = std::fs::read_to_string(path).expect("docs/config-reference.md");
    let blocks = toml_blocks(&reference, "gateway");
    assert_eq!(blocks.len(), 1, "one full example");
    if let Err(mismatch) = check::<ConfigFile>(&blocks[0]) {
        panic!("docs/config-reference.md, gateway: {mismatch}");
    }
}
