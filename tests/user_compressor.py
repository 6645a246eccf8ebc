"""A compressor file as a user writes one, outside the package: imported by
``horovod_sbc.registry.load_file`` (``advise --register``, ``bench scatter --register``) it
makes ``SBC(mode="stc_user")`` known. Here it is the built-in STC under another name (what a
user's own file declares and implements: ``docs/compressors.md``)."""
from horovod_sbc import registry
from horovod_sbc.compressors.stc import STC


class UserSTC(STC):
    name = "stc_user"
    summary = "STC, registered from a user's file"


registry.register(UserSTC())
