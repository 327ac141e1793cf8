import cases


def test_conv3d_depth_split(dist2):
    dist2.run(cases.check_equivalence, spec=("Conv3d", dict(in_channels=2, out_channels=3, kernel_size=3, padding=1)),
              shape=(2, 2, 8, 6, 5), grid=(2, 1, 1))
