//! `docs/config-reference.md` against [`super::RawConfig`]: its manager example names every key
//! of the manager's config file and no other (see `ongrid_service::config_reference`).

use ongrid_service::config_reference::{check, toml_blocks};

use super::RawConfig;

#[test]
fn the_reference_names_every_key_of_the_manager_and_no_other() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/config-reference.md");
    let reference = std::fs::read_to_string(path).expect("docs/config-reference.md");
    let blocks = toml_blocks(&reference, "manager");
    assert_eq!(blocks.len(), 1, "one full example");
    if let Err(mismatch) = check::<RawConfig>(&blocks[0]) {
        panic!("docs/config-reference.md, manager: {mismatch}");
    }
}
